"""The maths of training, below the loop that runs it: the optimizer, the LR schedule, the precision
(autocast and loss scaling), one step's forward and backward with its timer, and the train state."""
