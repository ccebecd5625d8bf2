"""The developer tooling around the scripted `sim` family (adapters/providers/sim.py): the
family over loopback HTTP (server.py, loopback.py), the recording upstream, the scenario
simulator, the demo, and a gateway on a background thread. Each starts whole gateways, so this
package sits in the top layer, beside the command line."""
