-- Back to 0013: no log of the store's removals.
DROP TABLE IF EXISTS block_removals;
