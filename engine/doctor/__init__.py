"""`deskfleet doctor`: the facts gathered on this PC and the pure judgements over them."""
