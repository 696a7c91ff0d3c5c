"""mooncaked.sim: trace-driven cluster simulator reusing the conductor's policy and cost models.

- `trace.load_trace`: Mooncake-format traces.
- `engine.simulate(trace, SimConfig, cost)`: discrete-event run -> SimResult.
- `sweep.capacity_sweep`: highest arrival rate per policy at an effective-capacity target
  (bisection, then a grid scan; `sweep.scan_capacity` reads highest passing / conservative).
- `hitrate.sequential_hit_rate`: the trace's hit rate bound at a cache capacity (Figure 9).
- `plots`: PNG figures.
"""
