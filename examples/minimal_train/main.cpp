// Replaced by the minimal training example once layers and trainer exist.
int main() { return 0; }
