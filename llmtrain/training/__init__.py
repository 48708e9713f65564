"""Training a model: the run's set-up, the step loop, its maths and its recovery."""
