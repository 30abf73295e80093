DROP TABLE IF EXISTS tracker_tokens;
