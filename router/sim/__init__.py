"""Tools: the simulator, the planner, traces and the decision benchmark. They may import anything; nothing serving imports them."""
