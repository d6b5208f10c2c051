"""Tools: engine benchmarks, the profile and verify. They may import anything; nothing serving imports them."""
