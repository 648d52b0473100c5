"""Tools around the compiler: the command line, the plan viewer, numerics comparison, local
launching, fake ranks, calibration and the activation meter. Nothing in autopar imports them."""
