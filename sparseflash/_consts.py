"""Constants the kernels and their launchers share (exp2-based softmax: scores scaled by log2(e))."""

import math

LOG2E = 1.0 / math.log(2.0)  # 1.4426950408889634
LN2 = math.log(2.0)  # 0.6931471805599453
