"""The training recipe's parts: config, run components, SFT cold start, the LLM judge, the GPU memory plan.

The recipe itself, Algorithm 1 top to bottom, is ``experiments/train.py`` (``python -m experiments.train``).
"""
