"""rljax: JAX-native reinforcement-learning post-training for language models.

Sub-packages are imported on demand; importing ``rljax`` itself pulls in nothing heavy, so
``from rljax.loss import ...`` costs only JAX, chex and numpy.
"""

__version__ = "0.1.0.dev0"
