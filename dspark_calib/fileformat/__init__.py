"""The toolkit both file formats share (tables, observed steps): schema versions, the
append-only migration lists, the read limits and the bounded Parquet reader that keeps every
read within them, and Arrow columns decoded straight from their buffers."""
