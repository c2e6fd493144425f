"""The trainer with a test reward registered: ``python tests/e2e_trainer.py --config X.yaml key=value ...``.

tests/test_train_e2e.py runs the trainer through this file, as a plain process and as a Ray job
entrypoint, because a reward registered with ``register_reward_schedule`` exists in the process
that registered it, and the trainer computes rewards in its driver process.

The reward, ``shorter_transcript``, is ``-len(response_text) / 100``: the untrained SmolLM2 never
answers or searches, so every built-in reward is 0 for all its samples, while two samples of one
prompt almost never write transcripts of the same length. So every group gets differing rewards,
non-zero advantages and a real policy-gradient step, whose direction the test checks.
"""

from __future__ import annotations

import sys

from raggym.rewards.schedules import RewardSchedule, StageSchedule, register_reward_schedule

METHOD = "shorter_transcript"
STAGE = "shorter_transcript"


def shorter_transcript_rewards(outcomes) -> list[float]:
    return [-len(o.response_text) / 100.0 for o in outcomes]


def shorter_transcript_schedule(options: dict) -> RewardSchedule:
    if options:
        raise ValueError(f"reward method {METHOD!r} takes no options, got {sorted(options)}")
    return RewardSchedule(METHOD, StageSchedule((STAGE,), (0,)), {STAGE: shorter_transcript_rewards})


register_reward_schedule(METHOD, shorter_transcript_schedule)

if __name__ == "__main__":
    from experiments.train import main

    sys.exit(main(sys.argv[1:]))
