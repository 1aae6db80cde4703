"""What a run learns from: prompt sources, reward functions, and the tasks forgesky ships
(tiny, arith)."""
