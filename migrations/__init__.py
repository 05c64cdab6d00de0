"""Alembic environment and versions for spectuner's store, shipped inside the package.

Driven from code by ``tuner.store.schema`` (``spectuner db upgrade|current|downgrade``); there is no
alembic.ini. Write a new version by hand or with ``alembic revision --autogenerate`` against a
config built by ``tuner.store.schema.alembic_config(url)``; a test checks the models and the
migrations agree on SQLite and PostgreSQL.
"""
