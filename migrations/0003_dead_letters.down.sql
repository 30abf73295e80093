DROP TABLE IF EXISTS save_outcomes;
DROP TABLE IF EXISTS dead_letters;
