"""The supervisor process: CLI, configuration, and the engine that owns the backends and models.

Imports ``worker`` and ``ipc``; nothing imports it.
"""
