"""The toolkit both file formats share (tables, observed steps): schema versions, the
append-only migration lists, and Arrow columns decoded straight from their buffers."""
