"""SPara: supernet parallelism (many weight-sharing subnets trained at once).

Not built yet: this subpackage is reserved for the search space, the deterministic
subnet sampler, the vectorized multi-subnet step and the search (issue "SPara").
"""
