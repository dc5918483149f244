"""The video source: cameras and files decoded straight into a supervisor's slots as streams.

A producer process like the gateway, importing only ``duomo.ipc`` (and PyAV, numpy): ``duomo
stream`` runs it, and a producer that wants the loop in its own process imports it from here.
"""
