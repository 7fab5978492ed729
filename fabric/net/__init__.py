"""Sockets shared by nodes, clients and relays: CurveZMQ keys, dialling, peer liveness,
the tracker link and the relay. No torch."""
