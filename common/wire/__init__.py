"""The Drafter hop on the wire: tensors, protobuf conversion, the same-host carrier."""
