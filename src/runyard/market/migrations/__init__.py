"""Alembic migrations for the market store (a package so that setuptools ships it)."""
