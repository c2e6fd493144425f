#!/bin/bash
# B: the sitting-11 pilot; stage 2's SGD lr sized from run A's stage-1 policy (argv 1)
set -f
source /root/runs/common.sh
cd /root/wt64s
$PY -m experiments.studies.routing --out /root/runs/issue64_pilot_sgd --sft-from /root/runs/issue64_sgd_stage1 "${STUDY_ARGS[@]}" $(stage2 $1) "${BASE[@]}"
