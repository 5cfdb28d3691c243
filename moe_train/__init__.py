"""moe-train: a pretraining launcher and training engine for dense and Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
