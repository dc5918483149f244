"""The apps ``duomo bench`` runs inside the peers' own environments (never imported by Duomo):
``triton_model`` is the Python-backend ``model.py`` of every Triton model, ``mosec_app`` the Mosec
service. Both run Duomo's own executors (``tools.bench.inprocess.open_executor``), one instance
per model, one ONNX Runtime thread per session, as a user wrapping these tasks would."""
