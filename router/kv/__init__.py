"""The shared kernel: the block key, events, the ledger, tiers, the percentile. Router and workers import it; it imports nothing else of orchard."""
