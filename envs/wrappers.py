"""Wrappers that survive batched stepping, and finding the object the rollout loop steps.

The rollout loop does not call ``env.step``: it calls ``begin_step`` for a whole batch of
episodes, retrieves for all of them at once and then calls ``finish_step`` (see
``envs.stepping``). A plain ``gymnasium.Wrapper`` that overrides ``step`` (``TransformReward``,
``TimeLimit``, a reward-shaping wrapper of your own) would therefore be skipped silently.
``BatchedStepWrapper`` is the base for wrappers that change step results in a way batched stepping
honours: override ``transform_result``, and it is applied to every ``StepResult`` of ``step``,
``begin_step``, ``finish_step`` and ``truncate`` alike. ``reset``-side wrappers need nothing
special: the loop calls ``reset`` on the outermost object.

``batched_step_env(env)`` takes what ``gymnasium.make`` returned (wrapped or not) and returns the
object whose ``begin_step``/``finish_step``/``truncate`` the loop must call: the outermost
``BatchedStepWrapper``, or else the environment itself. It refuses, with a ``TypeError``, any
wrapper whose ``step`` would be bypassed.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from envs.stepping import CONTEXT_MODES, BatchedStepEnv, RetrievalRequest, StepResult, step_through

# The bookkeeping wrappers gymnasium.make adds by default. Their step() only checks the call
# (PassiveEnvChecker: the first step's types; OrderEnforcing: reset before step), which the
# environments' own check_step_call also does, so batched stepping may go around them.
TRANSPARENT_WRAPPERS = (gymnasium.wrappers.PassiveEnvChecker, gymnasium.wrappers.OrderEnforcing)

PROTOCOL_METHODS = ("begin_step", "finish_step", "truncate", "check_step_call")
PROTOCOL_ATTRIBUTES = ("stop_strings", "record", "context_mode")


class BatchedStepWrapper(gymnasium.Wrapper):
    """Base of the wrappers that transform step results under both ``step`` and batched stepping.

    Subclasses override ``transform_result(result) -> StepResult`` (identity here). ``step`` is
    composed from ``check_step_call``, ``begin_step`` and ``finish_step``, so it gives exactly
    what batched stepping gives. ``stop_strings``, ``record``, ``dialect`` and ``context_mode``
    are those of the wrapped environment. Wrappers nest: the innermost transform runs first.
    """

    def __init__(self, env: gymnasium.Env):
        super().__init__(env)
        # The next object down the chain that speaks the protocol; resolving it here refuses a
        # step-overriding wrapper underneath at construction time.
        self.stepping_env = batched_step_env(env)

    def transform_result(self, result: StepResult) -> StepResult:
        """Change one step's result (reward shaping, extra info, …); identity by default."""
        return result

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return tuple(step_through(self, action))  # type: ignore[return-value]

    def check_step_call(self, action: Any) -> None:
        self.stepping_env.check_step_call(action)

    def begin_step(self, segment: str) -> StepResult | RetrievalRequest:
        outcome = self.stepping_env.begin_step(segment)
        if isinstance(outcome, RetrievalRequest):
            return outcome
        return self.transform_result(outcome)

    def finish_step(self, request: RetrievalRequest, result) -> StepResult:
        return self.transform_result(self.stepping_env.finish_step(request, result))

    def truncate(self, reason: str) -> StepResult:
        return self.transform_result(self.stepping_env.truncate(reason))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stepping_env.stop_strings

    @property
    def record(self):
        return self.stepping_env.record

    @property
    def dialect(self):
        return self.stepping_env.dialect

    @property
    def context_mode(self) -> str:
        return self.stepping_env.context_mode


def batched_step_env(env: gymnasium.Env):
    """The object of ``env``'s wrapper chain that batched stepping must call.

    Walks from the outside in: gymnasium's ``PassiveEnvChecker`` and ``OrderEnforcing`` (added by
    ``gymnasium.make``) and wrappers that leave ``step`` alone are passed through; the first
    ``BatchedStepWrapper`` is returned (it resolves its own inside); any other wrapper that
    overrides ``step`` is a ``TypeError``, as is an environment without the protocol's methods.
    """
    current = env
    while isinstance(current, gymnasium.Wrapper):
        if isinstance(current, BatchedStepWrapper):
            return current
        kind = type(current)
        if kind not in TRANSPARENT_WRAPPERS and kind.step is not gymnasium.Wrapper.step:
            raise TypeError(
                f"{kind.__name__} overrides step(), which batched stepping bypasses (the rollout loop "
                "calls begin_step/finish_step/truncate); subclass envs.BatchedStepWrapper and implement "
                "transform_result instead"
            )
        current = current.env
    if isinstance(current, BatchedStepEnv) and current.context_mode in CONTEXT_MODES:
        return current  # implements the protocol by construction; step_batch calls this per step
    missing = [name for name in PROTOCOL_METHODS if not callable(getattr(current, name, None))]
    missing += [name for name in PROTOCOL_ATTRIBUTES if not hasattr(current, name)]
    if missing:
        raise TypeError(
            f"{type(current).__name__} does not implement the batched-step protocol (missing: "
            f"{', '.join(missing)}); subclass envs.RagSearchEnv, envs.MultiKBRouteEnv or "
            "envs.BatchedStepEnv (see envs.stepping)"
        )
    if current.context_mode not in CONTEXT_MODES:
        raise TypeError(
            f"{type(current).__name__}.context_mode is {current.context_mode!r}; expected one of {CONTEXT_MODES}"
        )
    return current
