"""`selfspec tune`: a measured cost model of this machine picks each step's width per batch size.

- `cost.py`: forward time as a function of batch size and query tokens per request (a grid,
  interpolated);
- `acceptance.py`: tokens committed per step of each candidate configuration, from a short
  offline run on held-out prompts;
- `choose.py`: from the two, per batch size, the configuration (plain AR included) with the most
  expected output tokens per second, as a `decoding.widths.width_plan.WidthPlan`;
- `command.py`: the command line, its table and the commented serving config it writes.
"""
