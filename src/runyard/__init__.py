"""runyard: from raw data to an evaluated, reproducible, served model."""

__version__ = "0.1.0"
