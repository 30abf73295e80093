// Command hello is the package BuildBinary's tests build.
package main

import "fmt"

func main() {
	fmt.Println("hello from a built binary")
}
