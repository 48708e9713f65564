"""Training a model: the run's set-up in parts (plan, train module, batches, loop parts), the step
loop, its recovery, choosing the checkpoint to resume from, and launching ranks. The maths of a step
is engine's."""
