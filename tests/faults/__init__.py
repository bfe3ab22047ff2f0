"""Fault-injection suite (issue #18): damaged checkpoint files, SIGKILL at every stage of a save and
of pruning, a full disk (checkpoint, token shard, metrics and lock writes; a real tmpfs where one can
be mounted), two trainers on one directory, runs of NaN steps, and a rank killed under torchrun. For
each, nothing written before is lost and the resumed run equals an uninterrupted one bit for bit.
README.md holds the table: fault, what happened, data lost."""
