"""An emulated multi-node cluster on one Linux machine (root): one network namespace per node,
veth links into a bridge in a hub namespace, ``tbf`` bandwidth caps; real gloo replays run across
the nodes with ``torchrun --nnodes N`` and are compared with the simulator on a matching topology.

Modules: ``netns`` (build and tear down the namespaces and links), ``probe`` (measure what a link
delivers: TCP and gloo bandwidth, latency), ``run`` (start ``torchrun`` per node, collect the
replay JSON, always clean up), ``topology`` (the simulator topology describing a testbed),
``agreement`` (measured-vs-simulated table).
"""
