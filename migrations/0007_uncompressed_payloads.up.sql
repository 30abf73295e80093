-- Outbox values (save tasks carry hex hash chains and block ids) and hash
-- segments do not compress: pglz spent ~20x the time of the insert itself
-- on them and saved nothing (35,577 of 35,577 bytes for a 512-chunk save
-- task). Keep them out of line, uncompressed.
ALTER TABLE outbox ALTER COLUMN value SET STORAGE EXTERNAL;
ALTER TABLE tracker_hashes ALTER COLUMN hashes SET STORAGE EXTERNAL;
ALTER TABLE tracker_blocks ALTER COLUMN blocks SET STORAGE EXTERNAL;
