#!/bin/bash
set -f
# A: SFT and stage 1 only (killed once the step-5 policy is kept), to size stage 2's SGD lr on it
source /root/runs/common.sh
cd /root/wt64s
$PY -m experiments.studies.routing --out /root/runs/issue64_sgd_stage1 "${STUDY_ARGS[@]}" $(stage2 1e-3) "${BASE[@]}" run.keep_policy_every=5
