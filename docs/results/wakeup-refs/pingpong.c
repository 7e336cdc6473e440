// Wake-up references: ping-pong between two processes on separate CPUs, each side sleeping
// in the kernel every time: futex on shared memory, pipe, eventfd. Prints the median RTT.
#define _GNU_SOURCE
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#define N 20000
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
static double med(double*v){qsort(v,N,sizeof*v,cmp);return v[N/2]/1000.0;}
static void fwait(volatile uint32_t*w,uint32_t v){while(*w==v)syscall(SYS_futex,w,FUTEX_WAIT,v,0,0,0);}
static void fwake(volatile uint32_t*w){syscall(SYS_futex,w,FUTEX_WAKE,1,0,0,0);}
int main(){
  static double t[N];
  volatile uint32_t*m=mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  m[0]=0;
  if(!fork()){pin(1);for(uint32_t i=0;i<N;i++){fwait(&m[0],2*i);m[0]=2*i+2;fwake(&m[0]);}_exit(0);}
  pin(0);
  for(uint32_t i=0;i<N;i++){double s=now();m[0]=2*i+1;fwake(&m[0]);fwait(&m[0],2*i+1);t[i]=now()-s;}
  wait(0);printf("futex   %.1f us\n",med(t));
  int a[2],b[2];pipe(a);pipe(b);char c=0;
  if(!fork()){pin(1);for(int i=0;i<N;i++){read(a[0],&c,1);write(b[1],&c,1);}_exit(0);}
  for(int i=0;i<N;i++){double s=now();write(a[1],&c,1);read(b[0],&c,1);t[i]=now()-s;}
  wait(0);printf("pipe    %.1f us\n",med(t));
  int e1=eventfd(0,0),e2=eventfd(0,0);uint64_t one=1,v;
  if(!fork()){pin(1);for(int i=0;i<N;i++){read(e1,&v,8);write(e2,&one,8);}_exit(0);}
  for(int i=0;i<N;i++){double s=now();write(e1,&one,8);read(e2,&v,8);t[i]=now()-s;}
  wait(0);printf("eventfd %.1f us\n",med(t));
  int d[2];socketpair(AF_UNIX,SOCK_DGRAM,0,d);
  if(!fork()){pin(1);for(int i=0;i<N;i++){recv(d[1],&c,1,0);send(d[1],&c,1,0);}_exit(0);}
  for(int i=0;i<N;i++){double s=now();send(d[0],&c,1,0);recv(d[0],&c,1,0);t[i]=now()-s;}
  wait(0);printf("unix-dgram %.1f us\n",med(t));
  return 0;
}
