"""vLLM's side of ``SamplingParams.mode_slot_temperature``: a logits processor that samples the
token after the mode slot at its own temperature.

vLLM applies the request's temperature, then its argmax-invariant logits processors, then top-k and
top-p, and (``logprobs_mode="processed_logprobs"``) reports the log-probability of the result. This
processor is argmax-invariant (it rescales one row by a positive factor), so greedy decoding never
sees it, and on a row whose context ends at the slot it turns the ``z / T`` vLLM computed into
``raggym.generation.slot_logits`` (min-p at T, then ``z / T_slot``): the token is drawn from, and
reported under, that distribution after top-k and top-p, which is
``actors.engines.hf.process_logits``'s order too.

vLLM builds one instance per engine from ``engine_arguments``' ``logits_processors`` (this module is
imported in the engine-core process only); a request opts in through ``SamplingParams.extra_args``
(``actors.engines.vllm_engine.sampling_kwargs`` adds them). The context read is the request's prompt (the session's whole context) and
the ids sampled so far, so a slot the previous turn left open is found at the new turn's first token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import AutoTokenizer
from vllm import SamplingParams as VLLMSamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from actors.engines.vllm_engine import SLOT_MIN_P_ARG, SLOT_PATTERN_ARG, SLOT_TEMPERATURE_ARG
from raggym.generation import ModeSlotDetector, slot_logits


class ModeSlotTemperature(AdapterLogitsProcessor):
    """Per request with ``slot_extra_args``: rescale the row to ``T_slot`` when the context ends at the slot."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self._detectors: dict[str, ModeSlotDetector] = {}  # one per pattern, compiled once

    def is_argmax_invariant(self) -> bool:
        return True

    @classmethod
    def validate_params(cls, params: VLLMSamplingParams):
        args = params.extra_args or {}
        if SLOT_TEMPERATURE_ARG in args and not float(args[SLOT_TEMPERATURE_ARG]) > 0:
            raise ValueError(f"{SLOT_TEMPERATURE_ARG} must be > 0, got {args[SLOT_TEMPERATURE_ARG]!r}")

    def new_req_logits_processor(self, params: VLLMSamplingParams):
        args = params.extra_args or {}
        if SLOT_TEMPERATURE_ARG not in args or params.temperature <= 0:
            return None
        pattern = str(args[SLOT_PATTERN_ARG])
        detector = self._detectors.setdefault(pattern, ModeSlotDetector(pattern, self._decode))
        temperature, slot_temperature = float(params.temperature), float(args[SLOT_TEMPERATURE_ARG])
        min_p = float(args[SLOT_MIN_P_ARG])

        def rescale(prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
            if not detector.at_slot(prompt_ids, output_ids):  # output_ids: vLLM's live list of this request's ids
                return logits
            return slot_logits(logits, temperature, slot_temperature, min_p)  # logits here are z / T

        return rescale
