"""What kind of GPU kernel carries a Plan's hops (read by the simulator; the gloo executor ignores it).

A strategy attaches a :class:`KernelSpec` to its Plan to say how the real kernels it stands for
move rows; the simulator times the Plan's bytes accordingly (``moonep_sim.sim.kernels``). Executors
still never look at the strategy's name: the spec is plain data, like the Plan's byte matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_sim.errors import require

#: ``KernelSpec.sms`` value meaning "every SM of the GPU" (the low-latency kernels).
ALL_SMS = -1


@dataclass(frozen=True)
class KernelSpec:
    """How a Plan's dispatch and combine kernels run on a GPU.

    sms: SMs the kernels use (their SM budget): 0 = not declared (no SM cap), ``ALL_SMS`` (-1) =
        every SM of the GPU, else that many. The simulator caps each rank's send and receive rate
        at ``sms x sm_copy_GBps`` of the topology (``moonep_sim.sim.topology.Topology``).
    relay: True = a multi-hop Plan runs as one kernel whose relay ranks forward rows as they
        arrive, in messages of ``kernel_relay_message_rows`` rows (DeepEP's normal kernels); False
        = every hop is a separate collective that starts once the previous one ended on that rank.
    row_messages: True = every row is its own message (one RDMA write per (token, expert)
        selection, as the low-latency kernels send), charged ``kernel_nic_message_us`` each at the
        sending NIC.
    nic_only: True = same-node peers also go through the NICs (pure-RDMA kernels), not NVLink.
    planned: False = the kernels need no planning step before they run: no count exchange and no
        layout (the low-latency kernels write into fixed buffers and carry the counts themselves),
        so the simulator charges no planning work and no planning all-gather.
    """

    sms: int = 0
    relay: bool = False
    row_messages: bool = False
    nic_only: bool = False
    planned: bool = True

    def __post_init__(self) -> None:
        require(self.sms >= ALL_SMS, f"kernel sms ({self.sms}) must be >= -1 (-1 = all SMs, 0 = not declared)")


__all__ = ["ALL_SMS", "KernelSpec"]
