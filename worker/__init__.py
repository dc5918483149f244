"""What runs inside a model thread: backends, the batcher, the model worker loop, executors.

Imported by ``supervisor``; imports only ``ipc`` from this project. Heavy runtimes
(onnxruntime, cv2, acl) are imported by the backend or executor module that needs them.
"""
