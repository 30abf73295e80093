ALTER TABLE trackers RESET (fillfactor);
