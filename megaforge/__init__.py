"""megaforge: reinforcement-learning post-training of LLMs, from one CPU to many GPU nodes."""
__version__ = "0.1.0"
