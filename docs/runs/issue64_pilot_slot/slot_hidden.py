"""Slot hidden states by question type: how far apart the two types' contexts are where the mode is chosen."""
import json, sys, glob, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, policy = sys.argv[1], sys.argv[2]
kinds = {json.loads(l)["id"]: json.loads(l)["kind"] for l in open(f"{out}/world/train_questions.jsonl")}
tok = AutoTokenizer.from_pretrained(policy)
model = AutoModelForCausalLM.from_pretrained(policy, torch_dtype=torch.float32).eval()
graph_id, pass_id = tok.encode("graph", add_special_tokens=False)[0], tok.encode("passage", add_special_tokens=False)[0]
hs = {"direct": [], "graph_only": []}; gaps = {"direct": [], "graph_only": []}
for f in sorted(glob.glob(f"{out}/seed2/grpo/trajectories/step-*.jsonl"))[-4:]:
    for line in open(f):
        d = json.loads(line)
        if not d["mode_choice_positions"]:
            continue
        kind = kinds[d["episode"]["question_id"]]
        p = d["mode_choice_positions"][0]
        ids = torch.tensor([d["token_ids"][:p]])
        with torch.no_grad():
            o = model(input_ids=ids, output_hidden_states=True)
        hs[kind].append(o.hidden_states[-1][0, -1]); z = o.logits[0, -1]
        gaps[kind].append(float(z[graph_id] - z[pass_id]))
H = {k: torch.stack(v) for k, v in hs.items()}
mu = {k: v.mean(0) for k, v in H.items()}
allh = torch.cat(list(H.values())); centre = allh.mean(0)
between = float((mu["direct"] - mu["graph_only"]).norm())
within = float(torch.cat([H[k] - mu[k] for k in H]).norm(dim=-1).mean())
cos = float(torch.nn.functional.cosine_similarity(mu["direct"], mu["graph_only"], dim=0))
W = model.get_output_embeddings().weight; u = (W[graph_id] - W[pass_id]).float()
print(json.dumps({"contexts": {k: len(v) for k, v in H.items()}, "cosine_of_type_means": round(cos, 5),
                  "between_type_distance": round(between, 3), "within_type_spread": round(within, 3),
                  "mean_norm": round(float(allh.norm(dim=-1).mean()), 3),
                  "logit_gap_graph_minus_pass": {k: round(sum(v) / len(v), 3) for k, v in gaps.items()},
                  "type_mean_difference_along_graph_minus_pass": round(float((mu["graph_only"] - mu["direct"]) @ u), 4),
                  "shared_mean_along_graph_minus_pass": round(float(centre @ u), 4)}))
