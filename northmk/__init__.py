"""northmk: a serving engine for Cohere's North Mini Code on one Hopper GPU."""

__version__ = "0.1.0"
