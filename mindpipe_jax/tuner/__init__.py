"""EPara: the 4D configuration tuner that maximizes training entropyput.

Not built yet: this subpackage is reserved for the configuration space, the cost
model, the gradient-noise-scale estimator and the online tuner (issue "EPara").
"""
