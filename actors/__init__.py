"""Ray layer: thin actors around ``raggym`` and ``envs`` objects.

- ``actors.retrieval_service``: ``IndexShard``, ``GraphReplica``, ``RetrievalService``
- ``actors.env_runner``: ``EnvRunner`` (batched environments driving ``envs.rollout``, async retrieval)
- ``actors.engines``: ``HFEngine``, ``VLLMEngine``, ``RolloutWorker``
- ``actors.learner``: ``Learner`` / ``LearnerGroup`` (DeepSpeed), ``actors.weight_sync``
- ``actors.registry``: RLlib env registration
- ``actors.runtime``: ``RayRuntime`` / ``LocalRuntime``, the above composed into what a run drives

Submodules are imported on use, so ``import actors`` stays cheap.
"""
