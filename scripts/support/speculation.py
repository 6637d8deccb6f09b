"""A step cost for the speculation planner that a test or a benchmark fixes, so that it plans as
over a chosen network, whatever the timing of the (shared, noisy) machine it runs on."""

from __future__ import annotations

from diffuse.client.speculative import Cost, StepCost

# CPU peers over an 80 ms round trip: speculation pays, trees get sent.
ROUND_TRIP_80MS = Cost(0.118, 0.128, 0.0016)


class FixedCost(StepCost):
    """The planner's cost model fixed to `cost`: fitted and charged alike, never measured."""

    def __init__(self, cost: Cost):
        super().__init__()
        self.cost = cost

    def fit(self) -> Cost:
        return self.cost

    def charged(self, positions: int, seconds: float) -> float:
        return self.cost(positions)
