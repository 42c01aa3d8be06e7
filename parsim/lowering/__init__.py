"""Plan to program: the ops one training step lowers to on each rank (block computes, collectives, sends), and
every rank's own copy where ranks share cores."""
