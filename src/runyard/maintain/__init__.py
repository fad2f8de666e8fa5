"""A served model's upkeep, from the tenant's side: watch drift on a standing lease's endpoint, buy its
retraining on the market within a budget, and roll the retrained model out on the same lease."""
