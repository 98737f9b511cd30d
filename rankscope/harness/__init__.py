"""The harness that exercises rankscope end to end: fault scenarios on local runs and on the test
bed, the healing drills, the scale simulator and the demo. It starts the real parts (collector,
trainer with the agent, test-bed hosts) and is used by the tests, the benchmarks and the
`rankscope demo / scenario / simulate` commands; no part of the product imports it."""
