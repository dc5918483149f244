"""The process shell: one supervisor process, its control socket and its clients.

The server (``server``) and its service wrapper (``daemon``); the reactor and the per-client
state it multiplexes (``reactor``, ``connection``, ``attachment``, ``intake``, ``lending``,
``loan``); the control protocol (``control_messages``), the answers to it (``control_handlers``,
``control_jobs``) and what a client may take (``limits``); the watchdog; the worker processes
run beside it (``child_processes``, ``gateways``). It drives the engine (``supervisor.core``)
and never computes itself.
"""
