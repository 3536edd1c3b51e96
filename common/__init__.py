"""What both services share: the model and its checkpoints (model/), running it on a
device (runtime/), the speculation algorithms (spec/), the hop's encoding (wire/),
serving plumbing (serving/) and the client SDK with the demo (client/)."""
