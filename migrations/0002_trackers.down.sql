DROP TABLE IF EXISTS scheduler_dead_letters;
DROP TABLE IF EXISTS processed_records;
DROP TABLE IF EXISTS trackers;
