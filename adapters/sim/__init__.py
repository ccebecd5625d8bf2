"""The scripted `sim` family: in process (provider.py) and over loopback HTTP (server.py,
loopback.py), the scenario simulator, the demo, and a gateway on a background thread."""
