"""The KServe v2 (Open Inference Protocol) gateway: a front-end process on the shared-memory
data plane, serving Duomo's models over HTTP/REST and gRPC to callers that speak v2
(``tritonclient``, ``perf_analyzer``, KServe, Kubernetes probes).

A gateway worker is a producer like any other: it holds one ``ipc.Client`` and slots of its
own, so HTTP parsing, JSON and image decoding never run under the supervisor's GIL. It imports
only ``ipc`` from Duomo (never ``supervisor`` or ``worker``).

Modules: ``protocol`` (the v2 wire contract: model metadata and configuration, requests and
responses, datatypes, error statuses), ``images`` (encoded images decoded into a slot),
``regions`` (the system shared-memory extension), ``streams`` (a caller's camera named in the
request's parameters, as a stream of the supervisor), ``link`` (the supervisor as a gateway
worker sees it: connection, models, slots, streams), ``http_front`` and ``grpc_front`` (the two
transports), ``main`` (the worker process).
"""
